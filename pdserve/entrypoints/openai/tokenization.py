"""vLLM's /tokenize and /detokenize: the model's tokenizer (and chat template) over HTTP."""

from __future__ import annotations

from typing import Any

from pdserve.engine.async_llm import AsyncLLM
from pdserve.engine.input_processor import render_chat
from pdserve.protocol.errors import OpenAIError
from pdserve.protocol.tokenize import DetokenizeRequest, TokenizeChatRequest, TokenizeRequest


def tokenize(engine: AsyncLLM, req: TokenizeRequest) -> dict[str, Any]:
    tokenizer = engine.tokenizer
    if isinstance(req, TokenizeChatRequest):
        conversation = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            ids = render_chat(tokenizer, conversation, req.add_generation_prompt)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="messages") from None
    else:
        ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return {
        "count": len(ids),
        "max_model_len": engine.config.model_config.max_model_len,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None,
    }


def detokenize(engine: AsyncLLM, req: DetokenizeRequest) -> dict[str, Any]:
    vocab_size = engine.config.model_config.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab_size]
    if bad:
        raise OpenAIError(
            400,
            f"Token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1}).",
            param="tokens",
        )
    return {"prompt": engine.tokenizer.decode(req.tokens)}
