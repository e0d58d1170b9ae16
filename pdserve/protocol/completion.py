"""/v1/completions' request body."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    Field,
)

from pdserve.protocol.common import INTEGRAL, LOGPROBS, NonEmptyStr, TokenId
from pdserve.protocol.sampling import SamplingRequest


class CompletionRequest(SamplingRequest):
    prompt: (
        NonEmptyStr
        | Annotated[list[NonEmptyStr], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    # OpenAI's default for completions.
    max_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = 16
    logprobs: Annotated[int, Field(ge=0, json_schema_extra=LOGPROBS), INTEGRAL] | None = None
    echo: bool = False

    def asked_max_tokens(self) -> int | None:
        return self.max_tokens

    def asked_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | dict[str, Any]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": p}]
        return [x if isinstance(x, str) else {"prompt_token_ids": x} for x in p]
