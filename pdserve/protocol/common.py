"""What every request body shares: strict fields, ignored-field warnings, the fields not
implemented yet, stream options, structured-output formats, and the schema's model limits."""

from __future__ import annotations

import functools
import logging
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    model_validator,
)

logger = logging.getLogger(__name__)
# Not implemented yet, with the values that leave them off (what a client library may send as a
# default); any other value is refused, naming the field.
NOT_YET: dict[str, tuple[str, tuple[Any, ...]]] = {
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
LOGPROBS = {"x-limit": "max_logprobs"}


def off(name: str) -> dict[str, Any]:
    feature, off = NOT_YET[name]
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
