"""Request bodies of the OpenAI API (the fields pdserve honours) and their SamplingParams.

Unknown fields are ignored, as OpenAI's clients send some this server has no use for, and the
log names them (vLLM's warning); a known field of the wrong type (strictly: no coercion) or out
of range is a 400 that names it. So is a field of OpenAI's API or vLLM's that pdserve does not
implement yet, when the request turns it on: answering without it would look like success
(prose for a JSON schema, no tool call for a named tool).
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from pdserve.entrypoints.openai import tool_calls
from pdserve.kv_transfer_params import KVTransferParams
from pdserve.sampling_params import SamplingParams, StructuredOutputsParams
from pdserve.structured_output import grammar

logger = logging.getLogger(__name__)

# Not implemented yet, with the values that leave them off (what a client library may send as a
# default); any other value is refused, naming the field.
_NOT_YET: dict[str, tuple[str, tuple[Any, ...]]] = {
    "structural_tag": ("structural tags", (None,)),
    "functions": ("the deprecated functions; use tools", (None, [])),
    "function_call": ("the deprecated function_call; use tool_choice", (None, "none", "auto")),
    "logit_bias": ("logit bias", (None, {})),
    "bad_words": ("bad words", (None, [])),
    "allowed_token_ids": ("allowed token ids", (None,)),
    "use_beam_search": ("beam search", (None, False)),
    "best_of": ("best_of", (None, 1)),
    "suffix": ("suffix", (None, "")),
    "truncate_prompt_tokens": ("prompt truncation", (None,)),
}


# Token ids are non-negative; the app's schema adds the model's vocabulary as their maximum.


def _integral(value: Any) -> Any:
    """JSON Schema's integer: 2.0 is one (no other coercion; strict mode refuses the rest)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Constraints go before it in Annotated: after it, pydantic cannot put them in the schema.
INTEGRAL = BeforeValidator(_integral)
TokenId = Annotated[int, Field(ge=0, json_schema_extra={"x-limit": "vocab"}), INTEGRAL]
NonEmptyStr = Annotated[str, Field(min_length=1)]
_LOGPROBS = {"x-limit": "max_logprobs"}


def _off(name: str) -> dict[str, Any]:
    feature, off = _NOT_YET[name]
    return {"enum": list(off), "description": f"not supported by pdserve yet ({feature})"}


# Strict: a field's value is taken only as its declared type (no "true" for a bool, no 1.5 for
# a token id), as the OpenAPI schema says; an int is still a float.
_STRICT = ConfigDict(extra="ignore", strict=True)


@functools.cache
def _accepted_keys(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(field.alias or name for name, field in model.model_fields.items())


class OpenAIBaseModel(BaseModel):
    """vLLM's OpenAIBaseModel: a field the body has and the model lacks is ignored, and one
    warning names them all, so that a client learns that a field it relies on did nothing."""

    model_config = _STRICT

    @model_validator(mode="wrap")
    @classmethod
    def _log_ignored_fields(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        result = handler(data)
        if isinstance(data, dict):
            ignored = data.keys() - _accepted_keys(cls)
            if ignored:
                logger.warning(
                    "The following fields were present in the request but ignored: %s", ignored
                )
        return result


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far.
    continuous_usage_stats: bool = False

    @staticmethod
    def continuous(options: StreamOptions | None) -> bool:
        return options is not None and options.include_usage and options.continuous_usage_stats


class JsonSchemaFormat(OpenAIBaseModel):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's response_format: text (no constraint), any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(OpenAIBaseModel):
    """vLLM's structured_outputs request field (one constraint; SamplingParams checks it)."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[NonEmptyStr] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class _SamplingRequest(OpenAIBaseModel):
    # kv_transfer_params is a msgspec struct, which the validator builds.
    model_config = ConfigDict(extra="ignore", strict=True, arbitrary_types_allowed=True)

    model: str | None = None
    # The ranges SamplingParams checks, declared so that the schema says them.
    # At most --max-num-seqs (filled in per app): every sequence of a request runs at once.
    n: Annotated[int, Field(ge=1, json_schema_extra={"x-limit": "max_num_seqs"}), INTEGRAL] = 1
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: Annotated[int, Field(ge=-1), INTEGRAL] | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    # The largest double below 2**63 is the top: a JSON number past it would not be an int64.
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1024), INTEGRAL] | None = None
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)
    min_tokens: Annotated[int, Field(ge=0), INTEGRAL] = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extension: the prompt tokens' logprobs, that many alternatives each.
    prompt_logprobs: Annotated[int, Field(ge=0, json_schema_extra=_LOGPROBS), INTEGRAL] | None = (
        None
    )
    # A msgspec struct, which the validator builds; the schema shows the JSON object it takes.
    kv_transfer_params: Annotated[
        KVTransferParams | None,
        WithJsonSchema({"type": ["object", "null"], "description": "vLLM's kv_transfer_params"}),
    ] = None
    # vLLM's: only requests with the same salt share prefix-cache blocks, so that one tenant
    # cannot learn from a hit's timing what another sent.
    cache_salt: NonEmptyStr | None = Field(
        default=None,
        description="vLLM's prefix-cache salt: requests share cached blocks only with requests "
        "of the same salt. Make it a secret, random and long (such as 256 bits, base64-encoded).",
    )
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older names for structured_outputs' constraints.
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[NonEmptyStr] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    # Not implemented yet: the schema takes only the values that leave them off.
    structural_tag: Any = Field(default=None, json_schema_extra=_off("structural_tag"))
    functions: Any = Field(default=None, json_schema_extra=_off("functions"))
    function_call: Any = Field(default=None, json_schema_extra=_off("function_call"))
    logit_bias: Any = Field(default=None, json_schema_extra=_off("logit_bias"))
    bad_words: Any = Field(default=None, json_schema_extra=_off("bad_words"))
    allowed_token_ids: Any = Field(default=None, json_schema_extra=_off("allowed_token_ids"))
    use_beam_search: Any = Field(default=None, json_schema_extra=_off("use_beam_search"))
    best_of: Any = Field(default=None, json_schema_extra=_off("best_of"))
    suffix: Any = Field(default=None, json_schema_extra=_off("suffix"))
    truncate_prompt_tokens: Any = Field(
        default=None, json_schema_extra=_off("truncate_prompt_tokens")
    )

    @field_validator(*_NOT_YET)
    @classmethod
    def _refuse_what_is_not_implemented(cls, value: Any, info: ValidationInfo) -> Any:
        feature, off = _NOT_YET[info.field_name]  # type: ignore[index]
        if any(value == v and type(value) is type(v) for v in off):
            return value
        raise PydanticCustomError(
            "not_supported",
            "is not supported by pdserve yet ({feature}); leave it out or send {off}",
            {
                "feature": feature,
                "off": " or ".join(repr(v) for v in off if v is not None) or "null",
            },
        )

    @field_validator("kv_transfer_params", mode="before")
    @classmethod
    def _check_kv_transfer_params(cls, value: Any) -> KVTransferParams | None:
        return None if value is None else KVTransferParams.from_json(value)

    @field_validator("cache_salt", mode="before")
    @classmethod
    def _check_cache_salt(cls, value: Any) -> Any:
        if value is not None and (not isinstance(value, str) or not value):
            raise PydanticCustomError("cache_salt", "must be a non-empty string if provided")
        return value

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one constraint the request asks for, checked; ValueError naming the field."""
        asked: list[tuple[str, StructuredOutputsParams]] = []
        tool_constraint = (
            self.tool_constraint() if isinstance(self, ChatCompletionRequest) else None
        )
        if tool_constraint is not None:
            asked.append(("tool_choice", tool_constraint))
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ValueError("response_format.json_schema.schema is required for json_schema.")
            asked.append(
                (
                    "response_format.json_schema.schema",
                    StructuredOutputsParams(json=fmt.json_schema.schema_),
                )
            )
        if self.structured_outputs is not None:
            so = self.structured_outputs
            asked.append(
                (
                    "structured_outputs",
                    StructuredOutputsParams(
                        json=so.json_,
                        regex=so.regex,
                        choice=so.choice,
                        grammar=so.grammar,
                        json_object=so.json_object,
                        disable_any_whitespace=so.disable_any_whitespace,
                    ),
                )
            )
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if (value := getattr(self, name)) is not None:
                asked.append(
                    (name, StructuredOutputsParams(**{name.removeprefix("guided_"): value}))
                )
        if not asked:
            return None
        if len(asked) > 1:
            raise ValueError(
                f"{asked[1][0]} is a second structured-outputs constraint; {asked[0][0]} is "
                "already one, and a request takes one."
            )
        name, params = asked[0]
        grammar.check(params, None if name == "structured_outputs" else name)
        return params

    def to_sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        defaults: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """Raises ValueError (its message starts with the field name) for an invalid value.
        `defaults`: the values of the sampling fields the request leaves unset."""
        set_fields = dict(defaults or {})
        set_fields |= {
            name: getattr(self, name)
            for name in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
            )
            if getattr(self, name) is not None
        }
        return SamplingParams(
            structured_outputs=self.structured_outputs_params(),
            n=self.n,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            **set_fields,
        )


class CompletionRequest(_SamplingRequest):
    prompt: (
        NonEmptyStr
        | Annotated[list[NonEmptyStr], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    # OpenAI's default for completions.
    max_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = 16
    logprobs: Annotated[int, Field(ge=0, json_schema_extra=_LOGPROBS), INTEGRAL] | None = None
    echo: bool = False

    def prompts(self) -> list[str | dict[str, Any]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": p}]
        return [x if isinstance(x, str) else {"prompt_token_ids": x} for x in p]


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


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    # None: up to the model's context length.
    max_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, json_schema_extra=_LOGPROBS), INTEGRAL] | None = None
    add_generation_prompt: bool = True

    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

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


class TokenizePromptRequest(OpenAIBaseModel):
    """vLLM's /tokenize of a prompt."""

    model: str | None = None
    prompt: str
    messages: None = None  # declared, so that a body with both fits neither form
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIBaseModel):
    """vLLM's /tokenize of chat messages under the model's template."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    prompt: None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


TokenizeRequest = TokenizePromptRequest | TokenizeChatRequest


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[TokenId]


def declare_model_limits(schema: dict[str, Any], limits: dict[str, int | None]) -> dict[str, Any]:
    """The served model's limits as maximums in the OpenAPI schema: token ids below the
    vocabulary size, logprobs up to --max-logprobs (None: no limit), at the nodes marked
    "x-limit"."""

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            limit = node.pop("x-limit", None)
            if limit is not None and limits[limit] is not None:
                node["maximum"] = limits[limit]
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema
