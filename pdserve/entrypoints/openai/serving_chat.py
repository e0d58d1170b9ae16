"""The chat completion endpoint, tool calls included (tool_calls.py): messages -> the chat
template -> engine request -> OpenAI's chat response or SSE stream."""

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
    prompt_logprobs_json,
    reporting_errors,
    sse,
    usage,
    usage_of,
)
from pdserve.outputs import CompletionOutput, RequestOutput
from pdserve.protocol import tool_calls
from pdserve.protocol.chat import ChatCompletionRequest
from pdserve.protocol.common import StreamOptions
from pdserve.protocol.errors import OpenAIError
from pdserve.protocol.tool_calls import TOOL_PARSERS
from pdserve.sampling_params import SamplingParams


class OpenAIServingChat:
    def __init__(self, serving: OpenAIServing, tool_parser: str | None = None) -> None:
        self.serving = serving
        # --enable-auto-tool-choice's parser (tool_choice "auto"); None: "auto" is refused.
        self.tool_parser = None if tool_parser is None else TOOL_PARSERS.get(tool_parser)()

    def prepare_chat(self, req: ChatCompletionRequest) -> list[tuple[Prompt, SamplingParams]]:
        self.serving.check_model(req.model)
        if req.tool_mode() == "auto" and self.tool_parser is None:
            raise OpenAIError(
                400,
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
                param="tool_choice",
            )
        try:
            token_ids = self.serving.engine.apply_chat_template(
                req.conversation(), req.template_tools()
            )
        except ValueError as e:
            raise OpenAIError(400, str(e), param="messages") from None
        _, token_ids = self.serving.tokenize({"prompt_token_ids": token_ids})
        prompt_logprobs = self.serving.prompt_logprobs(req)
        params = self.serving.sampling_params(
            req, req.asked_max_tokens(), req.asked_logprobs(), len(token_ids), prompt_logprobs
        )
        return [({"prompt_token_ids": token_ids, "cache_salt": req.cache_salt}, params)]

    async def chat(
        self, req: ChatCompletionRequest, request_id: str
    ) -> tuple[dict[str, Any], dict[str, str]]:
        prompts = self.prepare_chat(req)
        final: RequestOutput | None = None
        stream = self.serving.generate(prompts, request_id, req.kv_transfer_params, False)
        async for _, final in stream:  # noqa: B007
            pass  # the one output holds the whole answer
        assert final is not None
        choices = []
        for c in final.outputs:
            message, finish_reason = self._chat_message(req, c.text, c.finish_reason)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "token_ids": c.token_ids,
                    "logprobs": self._chat_logprobs(c, req.top_logprobs or 0),
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        response = {
            "id": f"chatcmpl-{request_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.serving.model_name,
            "choices": choices,
            "usage": usage([final]),
            "kv_transfer_params": as_json(final.kv_transfer_params),
        }
        if req.prompt_logprobs is not None:  # vLLM's place for them: the response's
            response["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs)
        return response, path_headers([final])

    async def chat_stream(self, req: ChatCompletionRequest, request_id: str) -> AsyncIterator[str]:
        prompts = self.prepare_chat(req)
        stream = self.serving.generate(prompts, request_id, req.kv_transfer_params, True)
        head = {
            "id": f"chatcmpl-{request_id}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.serving.model_name,
        }
        continuous = StreamOptions.continuous(req.stream_options)
        for index in range(req.n):
            delta = {"role": "assistant", "content": ""}
            chunk = {**head, "choices": [{"index": index, "delta": delta, "finish_reason": None}]}
            if continuous:  # vLLM's: the prompt is counted from the first chunk on
                chunk["usage"] = usage_of(len(prompts[0][0]["prompt_token_ids"]), 0, 0)
            yield sse(chunk)
        counts = UsageCounter()
        mode = req.tool_mode()
        tools = {} if mode == "none" else {i: self._tool_stream(req, mode) for i in range(req.n)}
        async for i, out in reporting_errors(stream):
            if isinstance(out, str):
                yield out
                return
            counts.add(i, out)
            for c in out.outputs:  # each output holds only the step's new part
                if not c.token_ids and not c.text and c.finish_reason is None:
                    continue
                finish_reason = c.finish_reason
                if not tools:
                    deltas = [{"content": c.text}]
                else:
                    tool_stream = tools[c.index]
                    deltas = tool_stream.feed(c.text)
                    if finish_reason is not None:
                        deltas += tool_stream.finish()
                        if tool_stream.called and mode != "named" and finish_reason == "stop":
                            finish_reason = "tool_calls"
                    # The step's tokens and logprobs ride on its last delta (or an empty one).
                    deltas = [{}] * (not deltas) + deltas
                for n, delta in enumerate(deltas, 1):
                    last = n == len(deltas)
                    choice = {
                        "index": c.index,
                        "delta": delta,
                        "token_ids": c.token_ids if last else [],
                        "logprobs": self._chat_logprobs(c, req.top_logprobs or 0) if last else None,
                        "finish_reason": finish_reason if last else None,
                    }
                    chunk = {**head, "choices": [choice]}
                    if continuous:
                        chunk["usage"] = counts.usage()
                    yield sse(chunk)
        if req.stream_options and req.stream_options.include_usage and counts.prompt:
            yield sse({**head, "choices": [], "usage": counts.usage()})
        yield "data: [DONE]\n\n"

    def _chat_message(
        self, req: ChatCompletionRequest, text: str, finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a whole answer, its tool calls read as the request's
        tool_choice says, and the finish reason they make it."""
        mode = req.tool_mode()
        calls: list[dict[str, Any]] = []
        content: str | None = text
        if mode == "named" and finish_reason == "stop":
            calls = [tool_calls.tool_call(req.tool_choice.function.name, text)]  # type: ignore[union-attr]
            content = None
        elif mode == "required" and finish_reason == "stop":
            calls = tool_calls.required_calls(text)
            content = None
        elif mode == "auto":
            content, calls = self.tool_parser.parse(text)  # type: ignore[union-attr]
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
            if mode != "named" and finish_reason == "stop":
                finish_reason = "tool_calls"
        return message, finish_reason

    def _tool_stream(self, req: ChatCompletionRequest, mode: str) -> tool_calls.ToolCallStream:
        name = req.tool_choice.function.name if mode == "named" else None  # type: ignore[union-attr]
        return tool_calls.ToolCallStream(mode, name, self.tool_parser)

    @staticmethod
    def _chat_logprobs(c: CompletionOutput, num_top: int) -> dict | None:
        if c.logprobs is None:
            return None

        def item(token: str | None, logprob: float) -> dict:
            token = token or ""
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        content = []
        for tid, entry in zip(c.token_ids, c.logprobs):
            # The sampled token is in the entry even when it is not among the top ones.
            top = sorted(entry.values(), key=lambda lp: lp.rank or 0)[:num_top]
            content.append(
                {
                    **item(entry[tid].decoded_token, entry[tid].logprob),
                    "top_logprobs": [item(lp.decoded_token, lp.logprob) for lp in top],
                }
            )
        return {"content": content}
