"""The API server's routes, on a module-level router (vLLM's api_server does the same): each
reads what it serves with from `app.state.server` (`ServerState`), which `build_app` sets."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import pdserve
from pdserve import envs
from pdserve.engine.async_llm import AsyncLLM
from pdserve.engine.core_client import EngineDeadError
from pdserve.entrypoints.openai.drain import Drain
from pdserve.entrypoints.openai.serving import OpenAIServing, Prompt
from pdserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pdserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pdserve.entrypoints.openai.tokenization import detokenize, tokenize
from pdserve.protocol.chat import ChatCompletionRequest
from pdserve.protocol.completion import CompletionRequest
from pdserve.protocol.errors import GENERATION_200, OpenAIError, error_responses
from pdserve.protocol.tokenize import DetokenizeRequest, TokenizeRequest
from pdserve.sampling_params import SamplingParams

router = APIRouter()

_GENERATION = {**GENERATION_200, **error_responses(400, 401, 404, 503)}
T = TypeVar("T")


@dataclass
class ServerState:
    engine: AsyncLLM
    serving: OpenAIServing
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    api_key: str | None
    drain: Drain | None


def server_state(request: Request) -> ServerState:
    return request.app.state.server


def request_id_of(request: Request) -> str:
    # The proxy sends one X-Request-Id through both hops of a split request.
    return request.headers.get("X-Request-Id") or uuid.uuid4().hex


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


@router.post("/v1/completions", responses=_GENERATION)
async def completions(body: CompletionRequest, request: Request) -> Response:
    completion = server_state(request).completion
    return await _generate(request, body, completion.completion, completion.completion_stream)


@router.post("/v1/chat/completions", responses=_GENERATION)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    chat = server_state(request).chat
    return await _generate(request, body, chat.chat, chat.chat_stream)


async def _generate(
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    full: Callable[[Any, str], Awaitable[tuple[dict, dict[str, str]]]],
    chunks: Callable[[Any, str], AsyncIterator[str]],
) -> Response:
    """Completions' and chat's one path: the whole answer, or a stream whose first chunk is
    produced here, so that a bad request is still a 400, not a stream."""
    rid = request_id_of(request)
    try:
        if body.stream:
            iterator = chunks(body, rid)
            first = await anext(iterator, "")
            return StreamingResponse(_prepend(first, iterator), media_type="text/event-stream")
        answer = await _with_cancellation(request, full(body, rid))
    except OpenAIError as e:
        if e.status < 500:  # refused before the engine saw it: free the prefill side's KV now
            await server_state(request).engine.handoff.release_if_rejected(
                body.kv_transfer_params, rid
            )
        raise
    if answer is None:
        return Response(status_code=499)
    answer_body, headers = answer
    return JSONResponse(answer_body, headers=headers)


async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    if first:
        yield first
    async for chunk in rest:
        yield chunk


async def _with_cancellation(request: Request, work: Awaitable[T]) -> T | None:
    """Run a non-streaming handler; if the client goes away first, cancel it (which aborts)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@router.post("/v1/completions/render", responses=error_responses(400, 401, 404))
async def completions_render(body: CompletionRequest, request: Request) -> list[dict]:
    """What each prompt would run as, without running it (vLLM's render endpoint): routers
    tokenize through it to score prefixes."""
    prepared = server_state(request).completion.prepare_completion(body)
    return _render(request, prepared, body.stream)


@router.post("/v1/chat/completions/render", responses=error_responses(400, 401, 404))
async def chat_completions_render(body: ChatCompletionRequest, request: Request) -> dict:
    return _render(request, server_state(request).chat.prepare_chat(body), body.stream)[0]


def _render(
    request: Request, prepared: list[tuple[Prompt, SamplingParams]], stream: bool
) -> list[dict[str, Any]]:
    request_id, model = request_id_of(request), server_state(request).serving.model_name
    return [
        {
            "request_id": request_id if len(prepared) == 1 else f"{request_id}-{i}",
            "token_ids": prompt["prompt_token_ids"],
            "model": model,
            "sampling_params": msgspec.to_builtins(params),
            "stream": stream,
        }
        for i, (prompt, params) in enumerate(prepared)
    ]


@router.post("/tokenize", responses=error_responses(400, 401, 404))
async def tokenize_endpoint(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    server = server_state(request)
    server.serving.check_model(body.model)
    return tokenize(server.engine, body)


@router.post("/detokenize", responses=error_responses(400, 401, 404))
async def detokenize_endpoint(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    server = server_state(request)
    server.serving.check_model(body.model)
    return detokenize(server.engine, body)


@router.get("/v1/models", responses=error_responses(401))
async def models(request: Request) -> dict[str, Any]:
    serving = server_state(request).serving
    card = {
        "id": serving.model_name,
        "object": "model",
        "owned_by": "pdserve",
        "max_model_len": serving.max_model_len,
    }
    return {"object": "list", "data": [card]}


@router.get(
    "/health",
    response_class=Response,
    responses={
        200: {"description": "Serving (an empty body)."},
        503: {
            "description": "Draining, or the engine is dead (the reason).",
            "content": {"application/json": {}},
        },
    },
)
async def health(request: Request) -> Response:
    server = server_state(request)
    if server.engine.dead_reason is not None:
        return error_response(OpenAIError(503, server.engine.dead_reason))
    if server.drain is not None and server.drain.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return Response(status_code=200)


@router.get("/server_info", responses=error_responses(401))
async def server_info(request: Request, config_format: str = "text") -> dict[str, Any]:
    """The engine's configuration (vLLM's endpoint): routers read the block size and the KV
    events' endpoints from it; a push-mode proxy reads where the KV side channel is."""
    engine = server_state(request).engine
    config = engine.config.to_json()
    info: dict[str, Any] = {
        "vllm_config": config if config_format == "json" else json.dumps(config)
    }
    if engine.config.kv_transfer_config is not None:
        info["kv_side_channel"] = {
            "host": envs.side_channel_host(),
            "port": envs.side_channel_port(),
        }
    return info


@router.get("/version", responses=error_responses(401))
async def version() -> dict[str, str]:
    return {"version": pdserve.__version__}


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}, **error_responses(401)},
)
async def metrics(request: Request) -> Response:
    engine = server_state(request).engine
    if engine.dead_reason is None:
        # Fresh numbers: the engine only reports by itself when it does something.
        try:
            await engine.refresh_stats()
        except (TimeoutError, EngineDeadError):
            pass
    return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)
