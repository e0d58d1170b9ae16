"""/tokenize's and /detokenize's request bodies (vLLM's)."""

from __future__ import annotations

from pydantic import (
    Field,
)

from pdserve.protocol.chat import ChatMessage
from pdserve.protocol.common import OpenAIBaseModel, TokenId


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
