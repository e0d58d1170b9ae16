"""The sampling fields of completions and chat requests, checked, and the SamplingParams they
make."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)
from pydantic_core import PydanticCustomError

from pdserve.kv_transfer_params import KVTransferParams
from pdserve.protocol.common import (
    INTEGRAL,
    LOGPROBS,
    NOT_YET,
    NonEmptyStr,
    OpenAIBaseModel,
    ResponseFormat,
    StreamOptions,
    StructuredOutputs,
    TokenId,
    off,
)
from pdserve.sampling_params import SamplingParams, StructuredOutputsParams
from pdserve.structured_output import grammar


class SamplingRequest(OpenAIBaseModel):
    """The fields completions and chat share, and their SamplingParams."""

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
    prompt_logprobs: Annotated[int, Field(ge=0, json_schema_extra=LOGPROBS), INTEGRAL] | None = None
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
    structural_tag: Any = Field(default=None, json_schema_extra=off("structural_tag"))
    functions: Any = Field(default=None, json_schema_extra=off("functions"))
    function_call: Any = Field(default=None, json_schema_extra=off("function_call"))
    logit_bias: Any = Field(default=None, json_schema_extra=off("logit_bias"))
    bad_words: Any = Field(default=None, json_schema_extra=off("bad_words"))
    allowed_token_ids: Any = Field(default=None, json_schema_extra=off("allowed_token_ids"))
    use_beam_search: Any = Field(default=None, json_schema_extra=off("use_beam_search"))
    best_of: Any = Field(default=None, json_schema_extra=off("best_of"))
    suffix: Any = Field(default=None, json_schema_extra=off("suffix"))
    truncate_prompt_tokens: Any = Field(
        default=None, json_schema_extra=off("truncate_prompt_tokens")
    )

    @field_validator(*NOT_YET)
    @classmethod
    def _refuse_what_is_not_implemented(cls, value: Any, info: ValidationInfo) -> Any:
        feature, off = NOT_YET[info.field_name]  # type: ignore[index]
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
        tool_constraint = self.tool_constraint()
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

    def tool_constraint(self) -> StructuredOutputsParams | None:
        """The structured outputs the request's tool choice asks for (chat's)."""
        return None

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
