"""Prompt -> EngineCoreRequest: tokenization and the checks that need the model's limits.

Shared by LLM (in-process) and AsyncLLM (engine in its own process), so both reject the same
inputs with the same messages before anything reaches the engine.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from transformers import PreTrainedTokenizerBase

from pdserve.config import EngineConfig
from pdserve.engine.messages import EngineCoreRequest
from pdserve.kv_connector.first_token import shipped_first_token
from pdserve.kv_transfer_params import KVTransferParams
from pdserve.sampling_params import SamplingParams

# A string, or vLLM's TextPrompt {"prompt": "..."} or TokensPrompt {"prompt_token_ids": [...]},
# either dict with an optional "cache_salt".
PromptType = str | dict[str, Any]
ChatMessages = list[dict[str, Any]]


def check_prompt(token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """Also run by the engine itself: a request from the network must not reach the model unchecked."""
    if not token_ids:
        raise ValueError("The prompt is empty.")
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise ValueError(f"Prompt token ids must be in [0, {vocab_size}).")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"The prompt has {len(token_ids)} tokens, which leaves no room for a generated "
            f"token within max_model_len={max_model_len}."
        )


def prompt_cache_salt(prompt: PromptType) -> str | None:
    """A prompt dict's `cache_salt`, checked as vLLM's server checks the request field."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError("cache_salt must be a non-empty string if provided.")
    return salt


def check_params_for_model(
    params: SamplingParams, vocab_size: int, max_logprobs: int, field: str = "logprobs"
) -> None:
    """What SamplingParams cannot check alone: stop token ids inside the vocabulary, and
    vLLM's --max-logprobs limit (-1: none). `field` names the request's logprobs field."""
    bad = [t for t in params.stop_token_ids or () if t >= vocab_size]
    if bad:
        raise ValueError(
            f"stop_token_ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})."
        )
    if max_logprobs < 0:
        return
    for name, num in ((field, params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
        if num is not None and num > max_logprobs:
            raise ValueError(
                f"{name} asks for {num}, more than max_logprobs={max_logprobs} allows "
                "(--max-logprobs)."
            )


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: ChatMessages,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The token ids of a conversation under the model's chat template (which gets the tools,
    when the request has some)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("The model's tokenizer has no chat template; use completions.")
    ids = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    # transformers 5 returns a BatchEncoding here; older versions a plain list.
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        mc = config.model_config
        self.tokenizer = tokenizer
        self.max_model_len = mc.max_model_len
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = mc.eos_token_ids
        self.max_logprobs = mc.max_logprobs
        self.architecture = mc.architecture
        self.has_state = mc.has_inner_state

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            text, token_ids = prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        else:
            raise ValueError(
                "A prompt is a string, or a dict with 'prompt' (a string) or 'prompt_token_ids'."
            )
        self.check_prompt(token_ids)
        return text, token_ids

    def check_prompt(self, token_ids: list[int]) -> None:
        check_prompt(token_ids, self.vocab_size, self.max_model_len)

    def apply_chat_template(
        self,
        messages: ChatMessages,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        return render_chat(self.tokenizer, messages, add_generation_prompt, tools)

    def make_request(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: KVTransferParams | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> EngineCoreRequest:
        check_params_for_model(params, self.vocab_size, self.max_logprobs)
        kv = kv_transfer_params
        if self.has_state and kv is not None and kv.do_remote_decode and params.max_tokens != 1:
            # Its block holds the state after every token computed, which must be the prompt's.
            raise ValueError(
                f"kv_transfer_params.do_remote_decode needs max_tokens=1 for {self.architecture}: "
                f"it hands over its recurrent state after the prompt alone (got max_tokens="
                f"{params.max_tokens})."
            )
        # Extra EOS ids of the generation config stop generation like stop_token_ids do.
        primary_eos = self.eos_token_ids[0] if self.eos_token_ids else None
        extra = [t for t in self.eos_token_ids[1:] if not params.ignore_eos]
        if extra:
            params = msgspec.structs.replace(
                params, stop_token_ids=list(dict.fromkeys((params.stop_token_ids or []) + extra))
            )
        first = shipped_first_token(
            kv_transfer_params,
            n=params.n,
            max_tokens=params.max_tokens,
            logprobs=params.logprobs,
            stop_token_ids=[*self.eos_token_ids, *(params.stop_token_ids or [])],
            room_after_it=len(token_ids) + 1 < self.max_model_len,
        )
        if first is not None and not 0 <= first < self.vocab_size:
            raise ValueError(
                f"kv_transfer_params.first_token_id must be in [0, {self.vocab_size})."
            )
        return EngineCoreRequest(
            request_id,
            token_ids,
            params,
            primary_eos,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            kv_transfer_params=kv_transfer_params,
            output_token_ids=[] if first is None else [first],
            cache_salt=cache_salt,
        )
