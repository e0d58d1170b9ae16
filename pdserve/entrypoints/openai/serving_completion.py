"""The completion endpoint: prompts -> engine requests -> OpenAI's completion response or SSE
stream (echo and logprobs included)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from pdserve.engine.handoff import path_headers
from pdserve.entrypoints.openai.serving import (
    OpenAIServing,
    Prompt,
    UsageCounter,
    as_json,
    clamp,
    first_kv_params,
    prompt_logprobs_json,
    reporting_errors,
    sse,
    usage,
)
from pdserve.outputs import CompletionOutput, Logprob, RequestOutput
from pdserve.protocol.common import StreamOptions
from pdserve.protocol.completion import CompletionRequest
from pdserve.sampling_params import SamplingParams


class OpenAIServingCompletion:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def prepare_completion(self, req: CompletionRequest) -> list[tuple[Prompt, SamplingParams]]:
        self.serving.check_model(req.model)
        prompt_logprobs = self.serving.prompt_logprobs(req)
        prepared = []
        for prompt in req.prompts():
            text, token_ids = self.serving.tokenize(prompt)
            params = self.serving.sampling_params(
                req, req.asked_max_tokens(), req.asked_logprobs(), len(token_ids), prompt_logprobs
            )
            engine_prompt = {
                "prompt": text,
                "prompt_token_ids": token_ids,
                "cache_salt": req.cache_salt,
            }
            prepared.append((engine_prompt, params))
        return prepared

    async def completion(
        self, req: CompletionRequest, request_id: str
    ) -> tuple[dict[str, Any], dict[str, str]]:
        prompts = self.prepare_completion(req)
        finals: dict[int, RequestOutput] = {}
        async for i, out in self.serving.generate(
            prompts, request_id, req.kv_transfer_params, False
        ):
            finals[i] = out
        choices = []
        for i, out in sorted(finals.items()):
            for c in out.outputs:
                choice = self._completion_choice(
                    req, i * req.n + c.index, c, out, req.echo, out.prompt_logprobs
                )
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
                choices.append(choice)
        return {
            "id": f"cmpl-{request_id}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.serving.model_name,
            "choices": choices,
            "usage": usage(finals.values()),
            "kv_transfer_params": as_json(first_kv_params(finals.values())),
        }, path_headers(finals.values())

    async def completion_stream(
        self, req: CompletionRequest, request_id: str
    ) -> AsyncIterator[str]:
        prompts = self.prepare_completion(req)
        stream = self.serving.generate(prompts, request_id, req.kv_transfer_params, True)
        head = {
            "id": f"cmpl-{request_id}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.serving.model_name,
        }
        counts = UsageCounter()
        continuous = StreamOptions.continuous(req.stream_options)
        # Each choice's text so far (its first chunk echoes the prompt), for text_offset.
        sent_chars: dict[int, int] = {}
        # A DELTA stream has a prompt's logprobs once, with its first output that has them.
        prompt_logprobs: dict[int, list] = {}
        async for i, out in reporting_errors(stream):
            if isinstance(out, str):
                yield out
                return
            counts.add(i, out)
            if out.prompt_logprobs is not None:
                prompt_logprobs[i] = out.prompt_logprobs
            for c in out.outputs:  # each output holds only the step's new part
                if not c.token_ids and not c.text and c.finish_reason is None:
                    continue
                index = i * req.n + c.index
                choice = self._completion_choice(
                    req,
                    index,
                    c,
                    out,
                    req.echo and index not in sent_chars,
                    prompt_logprobs.get(i),
                    sent_chars.get(index, 0),
                )
                sent_chars[index] = sent_chars.get(index, 0) + len(choice["text"])
                chunk = {**head, "choices": [choice]}
                if continuous:
                    chunk["usage"] = counts.usage()
                yield sse(chunk)
        if req.stream_options and req.stream_options.include_usage:
            yield sse({**head, "choices": [], "usage": counts.usage()})
        yield "data: [DONE]\n\n"

    def _completion_choice(
        self,
        req: CompletionRequest,
        index: int,
        c: CompletionOutput,
        out: RequestOutput,
        echo: bool,
        prompt_logprobs: list[dict[int, Logprob] | None] | None = None,
        text_offset: int = 0,
    ) -> dict:
        """One choice, or a stream's chunk of it. `echo`: it starts with the prompt (text and,
        with logprobs, `prompt_logprobs`' entries); `text_offset`: the choice's text before."""
        text, token_ids, entries = c.text, c.token_ids, c.logprobs
        if echo:
            prompt = out.prompt
            if prompt is None:
                prompt = self.serving.engine.tokenizer.decode(out.prompt_token_ids)
            text = prompt + text
            if entries is not None:
                # Without the prompt's logprobs (a decode instance's) its entries are empty.
                prompt_entries = prompt_logprobs or [None] * len(out.prompt_token_ids)
                token_ids, entries = out.prompt_token_ids + token_ids, prompt_entries + entries
        return {
            "index": index,
            "text": text,
            "logprobs": None
            if entries is None
            else self._completion_logprobs(token_ids, entries, req.logprobs or 0, text_offset),
            "token_ids": c.token_ids,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }

    def _completion_logprobs(
        self,
        token_ids: list[int],
        entries: list[dict[int, Logprob] | None],
        num_top: int,
        text_offset: int,
    ) -> dict[str, list]:
        """OpenAI's completion logprobs, as vLLM builds them: the token, its logprob and the
        top ones (the token and `num_top` more), null for a token without an entry (the first
        of an echoed prompt); each token's offset is the previous one's plus its length."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for tid, entry in zip(token_ids, entries):
            if entry is None:
                token = self.serving.engine.tokenizer.decode([tid])
                token_logprobs.append(None)
                top.append(None)
            else:
                token = entry[tid].decoded_token or ""
                token_logprobs.append(clamp(entry[tid].logprob))
                top.append(
                    {
                        lp.decoded_token: clamp(lp.logprob)
                        for j, lp in enumerate(entry.values())
                        if j <= num_top
                    }
                )
            tokens.append(token)
            offsets.append(text_offset)
            text_offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }
