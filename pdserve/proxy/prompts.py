"""A request's prompt as token ids, computed in the proxy the way its instances will: the
cache-aware router hashes them (proxy/routing.py)."""

from __future__ import annotations

import logging

from pdserve.engine.input_processor import render_chat
from pdserve.models import loader
from pdserve.protocol.chat import ChatCompletionRequest
from pdserve.protocol.completion import CompletionRequest

logger = logging.getLogger(__name__)


class PromptTokens:
    """Empty until it has a tokenizer: given (`pdserve proxy --model`) or the instances' own,
    found through their /server_info when the proxy can read it (same host, shared storage)."""

    def __init__(self, model: str | None = None) -> None:
        self.tokenizer = None
        if model is not None:
            self.load(model)

    def load(self, model: str | None) -> None:
        """`model` None: the default model (as an instance started without --model)."""
        if self.tokenizer is None:
            self.tokenizer = loader.load_tokenizer(loader.resolve_model_source(model))
            logger.info("Routing by prompt tokens, with the tokenizer of %s", model)

    def of(self, req: CompletionRequest | ChatCompletionRequest) -> list[int]:
        """The first prompt's token ids; [] when the proxy cannot compute them (the instance
        then answers for it), which routes the request without a cache preference."""
        if self.tokenizer is None:
            return []
        try:
            if isinstance(req, ChatCompletionRequest):
                return render_chat(self.tokenizer, req.conversation(), tools=req.template_tools())
            # A batch: its first prompt speaks for it.
            first = req.prompts()[0]
            if isinstance(first, str):
                return self.tokenizer.encode(first)
            return list(first["prompt_token_ids"])
        except (ValueError, TypeError, IndexError) as e:
            logger.debug("No prompt tokens for routing: %s", e)
        return []
