"""What the completion and chat endpoints share (serving_completion.py, serving_chat.py): the
checks, request -> engine requests, and the pieces of an OpenAI response or SSE stream."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from pdserve.engine.async_llm import AsyncLLM, RequestRejectedError
from pdserve.engine.core_client import EngineDeadError
from pdserve.engine.input_processor import check_params_for_model
from pdserve.kv_transfer_params import KVTransferParams
from pdserve.outputs import Logprob, RequestOutput, RequestOutputKind
from pdserve.protocol.chat import ChatCompletionRequest
from pdserve.protocol.completion import CompletionRequest
from pdserve.protocol.errors import OpenAIError
from pdserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
# --enable-log-requests: at INFO, whatever --log-level says (vLLM's request logger).
request_logger = logging.getLogger("pdserve.requests")

Prompt = str | dict[str, Any]


async def merge(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several prompts' output streams as they come; closing this closes them all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def drain(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
            await queue.put((i, None))
        except BaseException as e:  # handed to the consumer, which re-raises it
            await queue.put((i, e))

    tasks = [asyncio.create_task(drain(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLM,
        model_name: str,
        max_pending_requests: int | None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        mc = engine.config.model_config
        self.max_model_len = mc.max_model_len
        self.max_logprobs = mc.max_logprobs
        self.vocab_size = mc.vocab_size
        self.max_num_seqs = engine.config.scheduler_config.max_num_seqs
        # The generation config's, for the sampling fields a request leaves unset (vLLM's).
        self.default_sampling_params = mc.default_sampling_params
        self.max_pending_requests = max_pending_requests
        # The prefill hand-offs requests in flight here read, and by whom: a hand-off serves
        # one request, and a second one naming it (a replay, a reused X-Request-Id) fails.

    # ---- shared checks ---------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    def check_capacity(self) -> None:
        if self.engine.dead_reason is not None:
            raise OpenAIError(
                503,
                f"The engine is not available: {self.engine.dead_reason}",
                "ServiceUnavailableError",
            )
        if (
            self.max_pending_requests is not None
            and self.engine.num_in_flight >= self.max_pending_requests
        ):
            raise OpenAIError(
                503,
                f"The server is overloaded ({self.engine.num_in_flight} requests "
                "in flight); retry later.",
                "ServiceUnavailableError",
            )

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        try:
            return self.engine.tokenize(prompt)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="prompt") from None

    def sampling_params(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        max_tokens: int | None,
        logprobs: int | None,
        num_prompt_tokens: int,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        if req.n > self.max_num_seqs:
            raise OpenAIError(
                400,
                f"n is {req.n}, more sequences than run at once here "
                f"(max_num_seqs={self.max_num_seqs}).",
                param="n",
            )
        room = self.max_model_len - num_prompt_tokens
        if max_tokens is not None and max_tokens > room:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                f"prompt, {max_tokens} in the completion).",
                param="max_tokens",
            )
        try:
            params = req.to_sampling_params(
                room if max_tokens is None else max_tokens,
                logprobs,
                prompt_logprobs,
                self.default_sampling_params,
            )
            checked, field = params, "logprobs"
            if isinstance(req, ChatCompletionRequest):
                # top_logprobs is refused past the limit even with logprobs off, as the
                # schema's maximum says.
                checked = msgspec.structs.replace(params, logprobs=req.top_logprobs)
                field = "top_logprobs"
            check_params_for_model(checked, self.vocab_size, self.max_logprobs, field)
            return params
        except ValueError as e:
            raise OpenAIError(400, str(e), param=str(e).split(" ", 1)[0]) from None

    def generate(
        self,
        prompts: list[tuple[Prompt, SamplingParams]],
        request_id: str,
        kv_transfer_params: KVTransferParams | None,
        stream: bool,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """A stream gets each step's new part (DELTA), a response only the final outputs."""
        self.check_capacity()
        if len(prompts) > 1 and kv_transfer_params is not None:
            raise OpenAIError(
                400,
                "kv_transfer_params hand over one prompt's KV; this request has "
                f"{len(prompts)} prompts: send them one per request.",
                param="kv_transfer_params",
            )
        if request_logger.isEnabledFor(logging.INFO):
            for i, (prompt, params) in enumerate(prompts):
                request_logger.info(
                    "Received request %s: prompt_token_ids: %s, params: %s, kv_transfer_params: %s",
                    request_id if len(prompts) == 1 else f"{request_id}-{i}",
                    prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt,
                    params,
                    kv_transfer_params,
                )
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        streams = [
            self.engine.generate(
                prompt,
                params,
                request_id if len(prompts) == 1 else f"{request_id}-{i}",
                kv_transfer_params,
                kind,
            )
            for i, (prompt, params) in enumerate(prompts)
        ]
        return self._owning_ids(request_id, kv_transfer_params, _raising_on_error(merge(streams)))

    async def _owning_ids(
        self,
        request_id: str,
        kv_transfer_params: KVTransferParams | None,
        stream: AsyncIterator[tuple[int, RequestOutput]],
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """`stream`, as long as its request id and the hand-off it reads are its own: a
        duplicate of either is the client's error (400), which ends only that request."""
        with self.engine.handoff.claim(request_id, kv_transfer_params):
            started = False
            try:
                async for item in stream:
                    started = True
                    yield item
            except ValueError as e:
                if started:
                    raise
                # Refused before it reached the engine: its X-Request-Id names a request in
                # flight.
                raise OpenAIError(400, str(e)) from None

    # ---- for both endpoints ----------------------------------------------------------------

    def prompt_logprobs(self, req: CompletionRequest | ChatCompletionRequest) -> int | None:
        """What the engine computes of the prompt's logprobs: `prompt_logprobs`, or with echo
        and logprobs as many as `logprobs` (vLLM's rule). None on a decode instance: the prompt
        of a request that reads its KV from a prefill instance is computed there, so echo's
        prompt entries have no logprobs here (the proxy fills them in from its prefill hop)."""
        if req.prompt_logprobs is not None and req.stream and req.prompt_logprobs > 0:
            raise OpenAIError(
                400,
                "`prompt_logprobs` are not available when `stream=True`.",
                param="prompt_logprobs",
            )
        if req.kv_transfer_params is not None and req.kv_transfer_params.do_remote_prefill:
            if req.prompt_logprobs is not None:
                raise OpenAIError(
                    400,
                    "prompt_logprobs are computed where the prompt is: this request's prompt "
                    "was computed by the prefill instance its kv_transfer_params name; ask it.",
                    param="prompt_logprobs",
                )
            return None
        if req.prompt_logprobs is not None:
            return req.prompt_logprobs
        if isinstance(req, CompletionRequest) and req.echo:
            return req.logprobs
        return None


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def clamp(logprob: float) -> float:
    """-inf as OpenAI writes it (JSON has no infinities), as vLLM does."""
    return max(logprob, -9999.0)


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None] | None) -> list | None:
    """vLLM's `prompt_logprobs` of a choice: null first, then {token id: {logprob, rank,
    decoded_token}} per prompt token."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            tid: {"logprob": clamp(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in entry.items()
        }
        for entry in entries
    ]


def usage(outputs: Any) -> dict[str, Any]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return usage_of(prompt, completion, sum(o.num_cached_tokens for o in outputs))


def usage_of(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    """OpenAI's usage; `cached` is the prompt tokens a prefix cache served (vLLM fills the
    details only with --enable-prompt-tokens-details, pdserve always)."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class UsageCounter:
    """A stream's usage, counted from its deltas."""

    def __init__(self) -> None:
        self.prompt: dict[int, int] = {}  # prompt index -> its tokens
        self.cached: dict[int, int] = {}  # prompt index -> its cached tokens
        self.completion = 0

    def add(self, i: int, out: RequestOutput) -> None:
        self.prompt[i] = len(out.prompt_token_ids)
        self.cached[i] = out.num_cached_tokens
        self.completion += sum(len(c.token_ids) for c in out.outputs)

    def usage(self) -> dict[str, Any]:
        return usage_of(sum(self.prompt.values()), self.completion, sum(self.cached.values()))


def first_kv_params(outputs: Any) -> KVTransferParams | None:
    return next((o.kv_transfer_params for o in outputs if o.kv_transfer_params is not None), None)


def as_json(params: KVTransferParams | None) -> dict[str, Any] | None:
    return None if params is None else params.to_json()


class RequestFailedError(RuntimeError):
    """The engine ended the request with an error (today: its KV cache could not be loaded)."""


async def _raising_on_error(
    stream: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    async for i, out in stream:
        failed = next((c for c in out.outputs if c.finish_reason == "error"), None)
        if failed is not None:
            why = failed.error or "this instance's log says why"
            raise RequestFailedError(
                f"Request {out.request_id} failed in the engine: its KV cache could not be loaded "
                f"from the prefill instance: {why}."
            )
        yield i, out


async def reporting_errors(
    stream: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput | str]]:
    """Once a stream has begun its status is sent: a failure becomes an error event, then [DONE]."""
    try:
        async for item in stream:
            yield item
    except (EngineDeadError, RequestRejectedError, RequestFailedError) as e:
        code = {EngineDeadError: 503, RequestRejectedError: 400}.get(type(e), 500)
        yield -1, sse(OpenAIError(code, str(e)).body()) + "data: [DONE]\n\n"
